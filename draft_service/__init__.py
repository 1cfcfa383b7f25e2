"""The draft service: the small model; catches up on committed tokens and drafts token trees."""
