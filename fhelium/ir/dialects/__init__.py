"""fhelium's xDSL dialects: core (`fhelium`), `fhelium_ckks`, `fhelium_dist`, `fhelium_memory`."""
