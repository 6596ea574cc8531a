"""sluice.actors"""
