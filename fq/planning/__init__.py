"""Planning a campaign before any GPU is rented: which passes to encode and what they cost.

    recipe      fq-cartridge/2 recipes: nodes (bases, residual stages) and the products (chains) they publish
    plan        blocks, windows, staging and retirement, peak disk, the run identity (pure: make_plan)
    price       GPU-hours, dollars, wall time and storage from a cost table (fq-cost-table/1)
    calibrate   measuring a cost table on the device at hand by timing the encoder

What it may import: fq.core, fq.errors, fq.model (the SourceModel), fq.codec (calibrate times it, lazily).
Never provenance, workflow or anything above.
"""
