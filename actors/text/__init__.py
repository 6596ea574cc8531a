"""sluice.actors.text"""
