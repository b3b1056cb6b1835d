"""`stallfree bench`: the head-to-head runner (run), the loaders people pick instead (peers), the
decode+augment limit row (limit), resource sampling (usage) and the report (report).

Import the submodules directly; this package re-exports nothing, so the CLI can list the bench
variants (`stallfree.bench.variants`) without importing torch.
"""
