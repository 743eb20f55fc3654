from app.db import get_user

def handle(uid):
    user = get_user(uid)
    return {"user": user} if user else {"error": "not found"}
