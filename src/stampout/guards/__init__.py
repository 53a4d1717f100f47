"""Guards: sources, one rule per guard kind, the generated predicate, an entry's guards split in two."""
