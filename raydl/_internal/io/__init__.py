"""Reading bytes: filesystems and retries (fs), the disk cache, file listing and reads, parquet, the skip policy."""
