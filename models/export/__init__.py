"""Serving formats for trained draft heads (vLLM, TGI) and draftheads' own model-only format."""
