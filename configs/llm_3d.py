# A 3-D parallel LLM config: 8 ranks per data replica (tensor 2 x pipeline 4).
# Start with: torchrun --nproc-per-node 8 train.py --config configs/llm_3d.py
parallel = dict(
    tensor=2,
    pipeline=dict(size=4, interleaved_overlap=True),
    order="tp-cp-ep-dp-pp",
)
dist = dict(backend="auto", timeout=1800)
seed = 1024

model = dict(hidden_size=4096, num_layers=32, num_attention_heads=32, vocab_size=50432)
data = dict(seq_len=4096, micro_batch_size=1, global_batch_size=512)
optimizer = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
