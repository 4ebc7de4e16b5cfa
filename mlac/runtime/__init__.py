"""The runtime: load an artifact (loader), run the model (model, layers) over a paged latent cache
(kv_cache), pick tokens (sampling), and wrap it all for callers (engine, tokenizer).

Import the submodules directly; `mlac.Engine` and `mlac.SamplingParams` are the public entry points.
"""
