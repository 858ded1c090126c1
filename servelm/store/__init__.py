"""Model store: where model folders live, and how a spec (default, .gguf, hub id) becomes one."""
