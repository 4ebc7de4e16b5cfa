"""The runtime: load an artifact strictly (loader), build one rank's model (model, layers,
parallel) over a paged latent KV cache (kv_cache), run it in one process per rank (runner, dist),
schedule requests (scheduler), pick tokens (sampling), and serve callers (engine, tokenizer,
the HTTP server in serve/).

Import the submodules directly; `mlac.Engine` and `mlac.SamplingParams` are the public entry points.
"""
