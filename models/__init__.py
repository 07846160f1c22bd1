"""Neural modules and decoding algorithms: target loading, draft heads, speculative decoding, export.

Nothing here knows about distribution or configuration files; ``train/`` wires these pieces together.
"""
