"""sluice.actors.scheduler"""
