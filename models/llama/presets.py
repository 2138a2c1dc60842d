"""The Llama family's presets: published shapes (each model's config.json),
as fields of models.llama.model.LlamaConfig."""

# Published shapes (each model's config.json): name -> fields. Vocabulary 0 takes the data's.
PRESETS: dict[str, dict] = {
    "llama-tiny": dict(n_layer=4, n_head=8, n_kv_head=4, d_model=256, d_mlp=688,
                       max_seq_len=256, vocab_size=0),
    "llama-2-7b": dict(n_layer=32, n_head=32, n_kv_head=32, d_model=4096, d_mlp=11008,
                       max_seq_len=4096, vocab_size=32000),
    "llama-2-13b": dict(n_layer=40, n_head=40, n_kv_head=40, d_model=5120, d_mlp=13824,
                        max_seq_len=4096, vocab_size=32000),
    "llama-2-70b": dict(n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_mlp=28672,
                        max_seq_len=4096, vocab_size=32000),
    "llama-3-8b": dict(n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_mlp=14336,
                       max_seq_len=8192, vocab_size=128256, rope_theta=500000.0),
    # Llama 3.1: llama-3-8b's weights' shape, 128k positions by rope scaling
    "llama-3.1-8b": dict(n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_mlp=14336,
                         max_seq_len=131072, vocab_size=128256, rope_theta=500000.0,
                         rope_scaling=(8.0, 1.0, 4.0, 8192)),
    # Mistral-7B-v0.3: no sliding window (v0.1's was 4096 positions)
    "mistral-7b": dict(n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_mlp=14336,
                       max_seq_len=32768, vocab_size=32768, rope_theta=1000000.0,
                       family="mistral"),
    "qwen2-0.5b": dict(n_layer=24, n_head=14, n_kv_head=2, d_model=896, d_mlp=4864,
                       max_seq_len=32768, vocab_size=151936, rope_theta=1000000.0,
                       rms_eps=1e-6, tie_embeddings=True, qkv_bias=True, family="qwen2"),
    "qwen2-7b": dict(n_layer=28, n_head=28, n_kv_head=4, d_model=3584, d_mlp=18944,
                     max_seq_len=32768, vocab_size=152064, rope_theta=1000000.0,
                     rms_eps=1e-6, qkv_bias=True, family="qwen2"),
    # Mixtures of experts (models/llama/moe.py). moe-tiny computes with as many
    # parameters per token as llama-tiny: 2 experts of 344 for one MLP of 688.
    "moe-tiny": dict(n_layer=4, n_head=8, n_kv_head=4, d_model=256, d_mlp=344,
                     max_seq_len=256, vocab_size=0, n_experts=8, n_experts_per_tok=2,
                     router_aux_loss_coef=0.01, family="mixtral"),
    "mixtral-8x7b": dict(n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_mlp=14336,
                         max_seq_len=32768, vocab_size=32000, rope_theta=1000000.0,
                         n_experts=8, n_experts_per_tok=2, router_aux_loss_coef=0.02,
                         family="mixtral"),
    "qwen3-30b-a3b": dict(n_layer=48, n_head=32, n_kv_head=4, d_model=2048, d_mlp=6144,
                          head_dim=128, max_seq_len=40960, vocab_size=151936,
                          rope_theta=1000000.0, rms_eps=1e-6, qk_norm=True, n_experts=128,
                          n_experts_per_tok=8, d_expert=768, router_aux_loss_coef=0.001,
                          family="qwen3_moe"),
}
