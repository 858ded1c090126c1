"""Terminal sub-commands that run the engine in-process: `servelm generate` and `servelm chat`."""
