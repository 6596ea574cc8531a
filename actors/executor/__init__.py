"""sluice.actors.executor"""
