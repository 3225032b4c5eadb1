# The demo's config: 8 ranks as tensor 2 x pipeline 2 x data 2 (data is derived).
parallel = dict(tensor=2, pipeline=dict(size=2), order="tp-cp-ep-dp-pp")
dist = dict(backend="gloo", timeout=120)
seed = 1024

# Sections parallelctx does not own are kept as given: gpc.config.model.hidden_size
model = dict(hidden_size=1024, num_layers=8, vocab_size=32000)
optimizer = dict(lr=3e-4, weight_decay=0.1)
