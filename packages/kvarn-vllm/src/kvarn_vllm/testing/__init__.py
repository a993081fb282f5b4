"""Test-only helpers shipped with the package (off unless asked for)."""
