"""Data: the resolved dataset, the Loader contract, and one module per backend.

Import the submodules directly (`stallfree.data.build`, `stallfree.data.loader`,
`stallfree.data.readers.folders`); this package re-exports nothing, so importing a torch-free
part (the registry, the listing) stays torch-free.
"""
