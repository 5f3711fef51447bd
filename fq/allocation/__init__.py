"""Where the bits go: allocation by measured sensitivity (docs/allocation.md).

    units        the groups of linears that take one K together (exllamav3's one K per projection of all experts)
    error_model  an LDLQ trellis encode's error without encoding: its shape from the Hessian, its size from K
    sensitivity  the Fisher quadratic form of the source model's output in such an error (one backward pass)
    measure      Hessians, directions and each unit's predicted KL and bytes at every K, for a model in memory
    streamed     the same measurement one decoder layer in memory at a time (the calibration chain's layer)
    passes       how the streamed measurement walks the layers (pure: fq price counts its reads)
    solve        a K per unit under a byte budget (multiple-choice knapsack, with an optimality certificate)

What it may import: fq.core, fq.errors, fq.codec (shapes, the Hadamard transform, the encoder in tests); streamed
also fq.model and fq.hessian (a checkpoint's decoder layers as the calibration chain builds them). Never
planning, provenance, workflow or anything above.
"""
