"""What every layer of kmp may use: warnings at the user's line, plain-text
tables, the backend a feature needs."""
