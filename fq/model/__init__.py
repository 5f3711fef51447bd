"""The source model: what a checkpoint holds and how fq reads and writes its tensors.

    source         a Hugging Face MoE checkpoint from its metadata alone (config, index, shard sizes): SourceModel
    source_synth   synthetic checkpoint metadata of each naming family (python -m fq.model.source_synth)
    rehearsal      a GLM-5-sized FP8 source with trained-like random weights, for the campaign rehearsal (issue 43);
                   rehearsal_write writes its shards tensor by tensor, synth_weights makes the weights and FP8 blocks
    shards         safetensors files in the caller's order (one expert = one byte range) and a strict reader
    experts        routed-expert tensor names (ExpertLayout) and the EXL3 constants a tensor set implies
    usage          expert-usage statistics (fq-expert-usage/1), measured by routing text (fq usage)
    demo_model     the embedded trained demo checkpoint (package data under fq/data/demo/)
    demo_train     how that demo model was trained (tools/train_demo_model.py); its schedule (lr_at) and router
                   balancing (SelectionBalance) also train benchmarks/train_bench_moe.py

What it may import: fq.core, fq.errors, fq.codec (its codebook constants); torch, transformers and tokenizers only
inside functions (``import fq.model.source`` loads no torch). Never planning, provenance or anything above.
"""
