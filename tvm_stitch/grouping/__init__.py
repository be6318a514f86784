"""Which bindings of a dataflow block become one kernel: the greedy partition, the candidate groups and the
fusion program solved over their modeled times (the search), acyclicity, and the prices of candidate groups."""
