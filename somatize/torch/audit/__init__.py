"""Watching a network while it trains: `Audit`, and the measures it takes."""
