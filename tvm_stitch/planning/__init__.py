"""The plan (plain data) and the rules that make it from a fused PrimFunc: row-resident and row-split mappings, resources, candidates, features, the cost model."""
