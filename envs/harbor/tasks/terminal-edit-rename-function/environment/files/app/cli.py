from app import db

def main(uid):
    print(db.get_user(int(uid)))
