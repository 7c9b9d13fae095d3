"""Tool-call latency estimation and TTL computation (never imports engine)."""
