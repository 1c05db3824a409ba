"""Small helpers with no project imports: atomic file writes and checksums."""
