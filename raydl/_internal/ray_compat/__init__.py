"""Every use of Ray's private API, in one place (see docs/design.md)."""
