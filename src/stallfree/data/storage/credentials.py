"""What is wrong with a cloud's credentials, told from the files and variables themselves: a
service-account JSON whose key cannot sign, an Azure key that is not base64, an Azure account
with nothing to sign with. Each answer names the variable (and file) and the field, never a value.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The variables that name a service-account JSON file, in the order obstore reads them.
SERVICE_ACCOUNT_FILES = (
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_APPLICATION_CREDENTIALS",
)
# rsaEncryption (1.2.840.113549.1.1.1) as DER: what a PKCS#8 RSA key's algorithm field holds.
_RSA_OID = bytes.fromhex("06092a864886f70d010101")
_NEW_KEY = "download a new key for the service account (IAM > Service accounts > Keys)"
# The Azure key variables obstore reads (its aliases of one setting).
_AZURE_KEYS = ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_MASTER_KEY")
# Azure variables that name an account or an endpoint, not a way to sign.
_AZURE_NOT_CREDENTIALS = (
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ENDPOINT",
)


def service_account_problem(env: Mapping[str, str]) -> str | None:
    """What makes the service-account JSON a variable names unusable: "VAR (path) ...", or
    None where the file looks whole (or none is named)."""
    name = next((n for n in SERVICE_ACCOUNT_FILES if env.get(n)), "")
    if not name:
        return None
    where = f"{name} ({env[name]})"
    try:
        account = json.loads(Path(env[name]).read_text())
    except OSError as exc:
        return f"{where} cannot be read ({exc.strerror or type(exc).__name__}); point {name} at the key file"
    except ValueError:
        return f"{where} is not JSON: not a service-account key file; {_NEW_KEY}"
    if not isinstance(account, dict):
        return f"{where} is not a JSON object: not a service-account key file; {_NEW_KEY}"
    if account.get("type", "service_account") != "service_account" or account.get("disable_oauth"):
        return None  # a gcloud login, or an emulator's file: nothing to sign with
    for field in ("client_email", "private_key"):
        if not isinstance(account.get(field), str) or not account[field]:
            return f"{where} has no {field}; {_NEW_KEY}"
    if not _is_rsa_pem(account["private_key"]):
        return f"{where}: its private_key is not a PEM RSA private key (the value is not shown); {_NEW_KEY}"
    return None


def _is_rsa_pem(text: str) -> bool:
    """Whether `text` is a PEM block whose body is DER naming the RSA algorithm."""
    lines = [line.strip() for line in text.strip().splitlines()]
    if len(lines) < 3 or not lines[0].startswith("-----BEGIN ") or not lines[-1].startswith("-----END "):
        return False
    try:
        der = base64.b64decode("".join(lines[1:-1]), validate=True)
    except (binascii.Error, ValueError):
        return False
    return der[:1] == b"\x30" and (_RSA_OID in der[:40] or "RSA" in lines[0])


def azure_key_problem(config: Mapping[str, Any], env: Mapping[str, str]) -> str | None:
    """Which Azure account key is not base64 (as every Azure key is): "VAR's ...", or None."""
    named = [("AZURE_STORAGE_CONNECTION_STRING (its AccountKey)", config.get("account_key"))]
    named += [(name, env.get(name)) for name in _AZURE_KEYS]
    for where, key in named:
        if not key:
            continue
        try:
            base64.b64decode(str(key), validate=True)
        except (binascii.Error, ValueError):
            return (
                f"{where}: the account key is not base64 (the value is not shown); copy "
                "it again from the portal (Storage account > Access keys)"
            )
    return None


def azure_signer_found(config: Mapping[str, Any], env: Mapping[str, str], on_azure: bool) -> bool:
    """Whether obstore has a way to sign for an Azure account: a key or a SAS, any other Azure
    credential variable (a service principal, workload identity, the CLI, an emulator...), or
    a managed identity, which only an Azure machine (or App Service) has."""
    if config.get("account_key") or config.get("sas_key") or on_azure:
        return True
    if env.get("IDENTITY_ENDPOINT") or env.get("MSI_ENDPOINT"):  # App Service, Arc
        return True
    return any(k.startswith("AZURE_") and k not in _AZURE_NOT_CREDENTIALS and v for k, v in env.items())
