"""Steps: the commit protocol, reading committed steps, references, lineage, leases, retention and gc."""
