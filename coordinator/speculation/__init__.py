"""The economics of speculation: how many tokens each request drafts (the policy), what rounds
cost (learnt online), and which requests get a pre-draft."""
