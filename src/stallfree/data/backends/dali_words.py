"""The one place DALI's errors are told apart by their words. DALI raises RuntimeError for
everything (a library missing from its tree, an allocation, a file it cannot decode) and its
decoders write the real cause to stderr, so there is no type to go by. Each rule here is pinned
by tests/unit/test_dali_words.py to the words of the installed DALI 2.x, nvImageCodec and torch.
Imports no DALI: the torch backend's callers read these too.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A library DALI cannot load, by what names it ("dlopen libnvimgcodec.so failed!", nvImageCodec's
# "Failed to load nvjpeg library!"), or a pipeline that cannot be built at all: the machine's
# fault, never an image's (every pipeline would fail, the first good JPEG would be blamed).
_LIBRARIES = (("nvimgcodec", "nvimgcodec"), ("nvjpeg", "nvjpeg"))
_ENVIRONMENT = (
    "dlopen",
    "cannot open shared object",
    "critical error when building pipeline",
    "libnvimgcodec",
    "failed to load nvjpeg",
    "libnvjpeg",
)
# DALI's host allocator ("std::bad_alloc"), its CUDA ones, and torch's CPU allocator.
_MEMORY = (
    "out of memory",
    "bad_alloc",
    "can't allocate",
    "cudaerrormemoryallocation",
    "cuda allocation failed",
)
# The lines of a pipeline error that say where in DALI it happened, not what went wrong.
_FRAMES = (
    "Critical error in pipeline",
    "Error in CPU operator",
    "Error in MIXED operator",
    "Error in GPU operator",
    "Current pipeline object",
    "Stacktrace",
    "which was used",
    "File ",
    "encountered:",
)
# A decoder's line on stderr: "[ERROR] [jpeg_parser] Invalid marker" (in colour).
_LOGGED = re.compile(r"^\[ERROR[^\]]*\]\s*(\[\w+\]\s*)?")


def _plain(text: str) -> str:
    return _ANSI.sub("", text)


def missing_library(text: str) -> str:
    """What a DALI error says the machine lacks: "nvimgcodec", "nvjpeg", "other" (a pipeline
    that cannot be built here), or "" (not the environment's fault: a file's, say)."""
    lowered = _plain(text).lower()
    if not any(needle in lowered for needle in _ENVIRONMENT):
        return ""
    return next((name for name, needle in _LIBRARIES if needle in lowered), "other")


def says_out_of_memory(text: str) -> bool:
    """Whether an error's words are an allocation that failed (no type says so)."""
    lowered = text.lower()
    return any(needle in lowered for needle in _MEMORY)


def first_cause(text: str) -> str:
    """The line of a DALI error that says what went wrong, not where in DALI it happened."""
    lines = [_plain(line).strip() for line in text.splitlines() if line.strip()]
    if "encountered:" in lines:  # DALI 2.x: the operator's Python traceback, then the cause
        lines = lines[lines.index("encountered:") + 1 :]
    useful = [line for line in lines if not line.startswith(_FRAMES)]
    return (useful or lines or ["(no message)"])[0][:300]


def logged_causes(log: str) -> list[str]:
    """The causes a decoder wrote to stderr while it failed ("Premature end of JPEG data"),
    in order, without DALI's "[ERROR] [parser]" prefix."""
    lines = [_plain(line).strip() for line in log.splitlines()]
    return [_LOGGED.sub("", line) for line in lines if _LOGGED.match(line) or "rror" in line]


def fell_back_to_cpu(log: str) -> bool:
    """Whether what the `mixed` decoder wrote to stderr says it fell back to a CPU decode."""
    lowered = log.lower()
    return "fall" in lowered and "back" in lowered or "nvjpeg" in lowered
