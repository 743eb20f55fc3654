"""Agent programs that run inside a sandbox and reach the policy through the token-recording gateway."""
