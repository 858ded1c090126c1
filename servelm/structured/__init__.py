"""Structured outputs: text constrained to a JSON schema, a regular expression, a list of
choices or a grammar.

`grammar.py` turns a `StructuredOutput` into the grammar engine's own form and checks that it
compiles (the API process does, before admitting a request); `compiler.py` compiles grammars
for the engine-core process on a worker thread, cached by their text; `matcher.py` follows one
request's output tokens through its grammar and fills the token masks the sampler applies.
No torch here: the engine core imports this package.
"""
