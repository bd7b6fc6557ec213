"""What the tests share: models, data and an engine written as a user would, and the malformed-input corpus."""
