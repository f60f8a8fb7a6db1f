"""A model's precision plan: the decisions (`decisions`), what kmp applied
(`applied`), applying them (`apply`), and the token-id check (`token_ids`)."""
