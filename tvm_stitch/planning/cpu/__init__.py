"""CPU rules of the row-resident scheme: row tasks over the cores, vector lanes, chunks of long rows."""
