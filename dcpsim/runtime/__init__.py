"""What one rank owns: block tables, KV stores, the write path, the process group."""
