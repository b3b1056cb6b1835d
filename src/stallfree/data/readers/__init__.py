"""Where samples come from: class folders (folders), our tar shards (tarshards), other people's
WebDataset shards (webdataset), all listed into one compact `Listing` (listing); image headers
(headers) and safe decoding (imageio); the start-up header check and its cache (startup_check).

`folders.resolve_dataset` picks the reader. Re-exports nothing, so a torch-free reader stays so.
"""
