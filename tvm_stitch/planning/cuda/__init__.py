"""CUDA rules of the row-resident scheme: the launch shape of a row and what a block keeps on chip."""
