"""One storage layer for local paths and object stores (s3://, gs://, az://)."""
