"""The checker: reads KV stores the way attention does and judges them independently."""
