"""thinkserve.cluster"""
