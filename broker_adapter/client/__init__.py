"""What an agent uses to hand work to the adapter: the signed-envelope publishers."""
