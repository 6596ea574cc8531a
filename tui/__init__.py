"""sluice.tui"""
