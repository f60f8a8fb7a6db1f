"""What kmp tells the user: `kmp.doctor()`, the precision report, the audit,
non-finite debugging, the loss-scale monitor and its records, the collapse
guard and its diagnosis, the replica check."""
