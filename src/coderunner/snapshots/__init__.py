"""Snapshots on the host: each client's saved sessions, in a store only the server can reach."""
