"""The Llama family's presets: published shapes (each model's config.json),
as fields of models.llama.config.LlamaConfig."""

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
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): latent attention,
    # 256 routed experts in 8 groups (a token's 8 from its best 4) beside one
    # shared, sigmoid scores with an aux-loss-free selection bias, YaRN to
    # 163840 positions, the first 3 layers dense. The sequence-wise balance
    # loss, the bias's step and the MTP loss's weight are the paper's
    # (arXiv:2412.19437, 4.2: alpha = 0.0001, gamma = 0.001, lambda = 0.3 for
    # the first 10T tokens), training choices config.json does not hold; its
    # one MTP module is (num_nextn_predict_layers = 1).
    "deepseek-v3": dict(n_layer=61, n_head=128, n_kv_head=128, d_model=7168, d_mlp=18432,
                        max_seq_len=163840, vocab_size=129280, rms_eps=1e-6,
                        n_experts=256, n_experts_per_tok=8, d_expert=2048, n_shared_experts=1,
                        score_func="sigmoid", routed_scaling_factor=2.5, n_group=8,
                        topk_group=4, expert_bias=True, router_bias_update_rate=0.001,
                        router_aux_loss_coef=0.0001, first_k_dense_replace=3,
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128,
                        rope_yarn=(40.0, 4096, 32.0, 1.0, 1.0, 1.0), mtp_depth=1,
                        mtp_loss_weight=0.3, family="deepseek_v3"),
    # Kimi-K2 (moonshotai/Kimi-K2-Base config.json): DeepSeek-V3's architecture
    # with 384 experts in one group, 64 heads, one dense layer, YaRN x32.
    "kimi-k2": dict(n_layer=61, n_head=64, n_kv_head=64, d_model=7168, d_mlp=18432,
                    max_seq_len=131072, vocab_size=163840, rope_theta=50000.0, rms_eps=1e-6,
                    n_experts=384, n_experts_per_tok=8, d_expert=2048, n_shared_experts=1,
                    score_func="sigmoid", routed_scaling_factor=2.827, expert_bias=True,
                    router_bias_update_rate=0.001, first_k_dense_replace=1, q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128, rope_yarn=(32.0, 4096, 1.0, 1.0, 1.0, 1.0),
                    family="deepseek_v3"),
    # deepseek-v3's architecture at test size: every part of it, 4 experts' groups.
    "deepseek-tiny": dict(n_layer=5, n_head=4, n_kv_head=4, d_model=128, d_mlp=256,
                          max_seq_len=256, vocab_size=0, rms_eps=1e-6, n_experts=8,
                          n_experts_per_tok=2, d_expert=64, n_shared_experts=1,
                          score_func="sigmoid", routed_scaling_factor=2.5, n_group=4,
                          topk_group=2, expert_bias=True, router_bias_update_rate=0.001,
                          first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                          mtp_depth=1, mtp_loss_weight=0.3, family="deepseek_v3"),
}
