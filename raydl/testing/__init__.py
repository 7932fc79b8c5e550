"""Helpers for testing code that uses raydl (like ``torch.testing``): a local S3 server."""
