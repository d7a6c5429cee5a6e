"""thinkserve.router"""
