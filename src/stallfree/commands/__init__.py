"""The CLI's larger subcommands, one module each: `add_parser(sub)` and a `cmd_*` handler."""
