"""The only place torchjax imports private upstream API (see style.md: Private upstream API)."""
