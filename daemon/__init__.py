"""sluice.daemon"""
